"""embedjob's version, in a module of its own so that modules recording it (`host`) need
not import the package's entry points."""

__version__ = "0.1.0"
