"""Images in Tinker model inputs: checking them, rendering them into tokens and pixels (a CPU render
server until an engine runs, then the engine itself), and sampling from prompts with images."""
