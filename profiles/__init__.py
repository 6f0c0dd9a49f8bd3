"""The preset profiles, one TOML file each: ``memsave.load_profile("zero3")`` reads ``zero3.toml``.

This folder sits at the top of the repository and is installed as the package ``memsave.profiles``
(``package-dir`` in pyproject.toml). memsave reads it through ``importlib.resources``, or, in a checkout used
through ``PYTHONPATH`` with nothing installed, straight from this folder ([Note: where the presets are] in
memsave/config.py). It holds no code.
"""
