"""The frontend: JAX functions to PFunctions, and `@function` programs to graphs.

Tracing only records; it never runs a JAX computation eagerly.
"""
