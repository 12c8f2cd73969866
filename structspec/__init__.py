"""structspec: schema-guaranteed JSON extraction with speculative, grammar-constrained decoding."""

from structspec import layout as _layout

# From a checkout, structspec.kernels and structspec.worker are its kernels/ and worker/ folders
# (structspec/layout.py); an installed wheel holds them inside the package.
_layout.install_checkout_finder()
