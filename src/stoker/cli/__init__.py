"""The ``stoker`` command line: wiring only; the work lives in the library."""
