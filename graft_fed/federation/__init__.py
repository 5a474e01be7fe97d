"""What broker and nodes share: the manifest, bundle encoding, domain errors."""
