"""The OpenAI-compatible server: routes and validation (``app``), admission control and continuous
batching (``scheduler``, ``batching``), and its benchmark (``bench``)."""
