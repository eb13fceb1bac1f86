"""The OpenAI-compatible HTTP server over the runtime's engine (`compress serve`)."""
