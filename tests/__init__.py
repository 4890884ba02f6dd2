"""normlab's own tests: a package, so that its folders are never top-level names (a folder
``tests/torch`` must not pass for the torch library) and its helpers import as
``tests.support.<name>``."""
