"""sandman: run untrusted commands (AI coding agents) in a hardened container with a bubblewrap
layer inside, with narrow audited upcalls to the host."""

__version__ = "0.1.0"
