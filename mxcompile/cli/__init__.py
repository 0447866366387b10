"""The `mxcompile` command line: argument parsing and rendering only."""
