"""Real servers on 127.0.0.1 for the tests and benchmarks (moved out of the installed package in issue 31)."""
