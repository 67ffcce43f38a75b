"""The bottom layer: settings, the user-facing error, cache folders, the CPU, prompt files, chat
messages, tool calls and atomic writes. Imports nothing else of forerun (docs/architecture.md, Layers)."""
