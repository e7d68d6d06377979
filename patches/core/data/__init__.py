"""Data both recipes read: JSONL rows (:mod:`.rows`), decoded windows (:mod:`.video`), the sample dataset
(:mod:`.sample_dataset`), the content-keyed latent cache (:mod:`.latents`) and thread prefetch (:mod:`.prefetch`)."""
