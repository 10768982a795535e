.venv/bin/python bench/prefix_cache.py   # defaults: --system-tokens 1024 --questions 8 --max-new-tokens 128, int4, auto
