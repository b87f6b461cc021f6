"""The .pmx schema: pmx.fbs and the Python code flatc generates from it."""
