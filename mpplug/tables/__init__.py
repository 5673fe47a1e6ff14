"""Tables at a party: Arrow values, DuckDB SQL and private set intersection.

Imported lazily: nothing here loads pyarrow or duckdb until a table is used.
"""
