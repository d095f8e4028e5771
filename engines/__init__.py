"""Clients of other serving engines, used to regenerate data and to compare: llama.cpp's server and vLLM (run in
its own venv by vllm_runner.py, which imports nothing of ours)."""
