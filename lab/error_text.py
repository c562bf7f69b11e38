"""The informative line of an error Keras or its backend raised, for messages that name a problem.

Keras wraps a layer's error with the call's arguments and terminal bold;
TensorFlow puts a graph error's traceback before its message. What the lab
quotes of an error is its one line that says what went wrong.
"""

import re


def error_line(error):
    """The informative line of a Keras or TensorFlow error, without tracebacks or markup.

    Args:
        error: Exception.

    Returns:
        str, at most 300 characters.
    """
    found, key = missing_key(error)
    if found:
        # str() of a KeyError is the repr of its key (or of Keras' whole wrapped message).
        return f"KeyError: {key!r}"[:300]
    lines = [_strip_ansi(line).strip() for line in str(error).splitlines()]
    lines = [line for line in lines if line]
    if lines and lines[0].startswith("Graph execution error"):
        # A graph error lists the traceback of the failing op first; its message follows.
        after = [i for i, line in enumerate(lines) if line.startswith("File ")]
        lines = lines[after[-1] + 1:] if after else lines[1:]
    for line in lines:
        # Keras wraps a layer's error in "Exception encountered when calling ...".
        if not line.startswith(("Exception encountered", "[[")):
            return line[:300]
    return type(error).__name__


def _strip_ansi(text):
    # TensorFlow prefixes op errors with "{{function_node ...}}"; Keras bolds with ANSI codes.
    return re.sub(r"\{\{[^}]*\}\}\s*|\x1b\[[0-9;]*m|\s*\[Op:[^\]]*\]( name:\s*\S*)?", "", text)


def missing_key(error):
    """(True, key) when error is a KeyError, else (False, None).

    Keras re-raises a layer's error as the same type with the call's arguments
    added to the message; the original, with the key itself, is its context.
    """
    while isinstance(error, KeyError):
        wrapped = bool(error.args) and str(error.args[0]).startswith("Exception encountered")
        if not wrapped:
            return True, error.args[0] if error.args else None
        if not isinstance(error.__context__, KeyError):
            bold = re.search(r"\x1b\[1m(.*?)\x1b\[0m", error.args[0], re.DOTALL)
            return True, bold.group(1) if bold else None
        error = error.__context__
    return False, None
