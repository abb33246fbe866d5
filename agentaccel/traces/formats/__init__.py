"""Trace formats: each parser turns one source (a file, or a folder for folder formats) into
sessions of calls, or raises FormatError saying what is wrong."""
