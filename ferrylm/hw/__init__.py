"""The machine: topology probe (/proc, /sys, NVML), bandwidth measurement, `ferry doctor` checks."""
