"""The soak run (``make soak``: ``python -m benchmarks.soak``), in parts:
``settings`` (tolerances, the memory rule), ``networks`` (what is served),
``references`` (the JVP reference), ``traffic`` (good and malformed requests),
``memory`` (the server's RSS), ``clients`` (the processes that send them),
``summary`` (percentiles, JSON, plot) and ``__main__`` (the command)."""
