"""The calculator the tool-use recipes give SmolLM2 (recipes/sft_tools.yaml's demonstrations; the GRPO tools loop):
plain functions whose type hints and Google-style docstrings transformers' ``get_json_schema`` turns into the JSON
schemas listed to the model, and which the loop calls with the arguments the model writes."""


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.

    Returns:
        The product of a and b.
    """
    return a * b
