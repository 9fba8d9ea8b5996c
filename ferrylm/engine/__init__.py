"""The engine: sequences, scheduler, model runner, the step loop and the offline API."""
