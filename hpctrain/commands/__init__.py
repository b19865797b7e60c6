"""What each ``hpctrain`` subcommand does, a module per family; cli.py parses, dispatches and reports errors.

``parser`` (every subcommand's options and --help examples), ``jobs`` (``train`` and ``eval``, the commands that
start MPI), ``plan``, ``data`` (file conversions), ``tools`` (``inspect``, ``export``, ``sample``, ``predict``,
``plot``, ``config``, ``env``: one library call each). cli.py imports a command's module only to run it.
"""
