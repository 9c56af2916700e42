"""A LoRA policy's adapter to the engines, both halves: the adapter packed, written and published
under a new name per version (`adapter`), received and installed by each engine's workers
(`receiver`, `install`), merged into its base from tensors alone (`merge`); the transport:
`transport.LoraTransport`."""
