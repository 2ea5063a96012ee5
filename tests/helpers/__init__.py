"""Helpers shared by test modules (tiny configs, model builders, run and process utilities).

Test modules import these instead of importing each other, so that a test module can change without
breaking another one.
"""
