"""What the tests, scripts and benchmarks share (not installed with qarray):
``reference`` (NumPy references of every primitive), ``network`` (the
Tesseract's network in NumPy, float64), ``server`` (starting servers and
encoding arrays for them), ``models`` (small models the tests and benchmarks
both measure)."""
