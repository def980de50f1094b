"""The one exception type that reaches the user as a single line."""


class LitftError(Exception):
    """A problem with the user's input or files, worded as what to change.

    The CLI prints it as ``litft: error: <message>`` without a traceback; anything
    else that escapes is a bug in litft and keeps its traceback.
    """
