"""`specgraph serve`: the OpenAI API over a program (server.py), its engine driven from a thread of
its own (loop.py), request shapes and errors (protocol.py), text streamed up to stop strings
(textstream.py), and Prometheus metrics (metrics.py)."""
