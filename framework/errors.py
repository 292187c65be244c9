"""The one exception type for mistakes the user can fix (recipe, data, paths, launch settings)."""


class UserError(Exception):
    """A problem with the user's input. The CLI prints its message and exits with status 2, no traceback.

    The message names the key or file and says how to fix it.
    """
