"""The OpenAI-compatible server: routes (app), admission and continuous batching (scheduler, batching), benchmark (bench)."""
