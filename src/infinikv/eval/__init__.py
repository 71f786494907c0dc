"""Quality measurements; each names the protocol of ``design.md`` it implements."""
