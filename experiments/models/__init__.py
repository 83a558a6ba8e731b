"""Models written as users write them (file.py:build references) for measurements."""
