"""Chat questions the benchmarks share, so engine and server figures use the same prompts."""

QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in two sentences.", "Write a haiku about the sea.",
    "List three uses of copper.", "Why is the sky blue?", "Give me a tip for learning Python.",
    "What does a ferry do?", "Summarise the plot of Cinderella.", "How do vaccines work?",
    "Name five fruits that are red.", "What is 17 times 23?", "Describe a cat to someone who has never seen one.",
    "What is the tallest mountain on Earth?", "Translate 'good morning' into Spanish.", "What is a prime number?",
    "Suggest a name for a bakery.",
]
