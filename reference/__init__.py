"""The reference implementation: readable NumPy, the specification in code. No torch below here."""
