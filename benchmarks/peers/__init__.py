"""Against the peers' own code (SGLang's and vLLM's), run from their wheels."""
