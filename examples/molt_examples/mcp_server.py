"""A small MCP server with two deterministic tools, a calculator and a unit converter.

An MCP client starts it as a subprocess (`python mcp_server.py`) and speaks JSON-RPC on its
stdin and stdout (the stdio transport). It imports only the `mcp` SDK, so it runs whether or not
molt_examples is installed. `molt_examples.mcp_agent` makes its data with the same functions.
"""

from __future__ import annotations

import ast
import operator

from mcp.server.mcpserver import MCPServer

server = MCPServer("molt-units", instructions="Exact arithmetic and unit conversion.")

_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}

# Factors to the base unit of each dimension (metre, kilogram, second); temperature is affine.
FACTORS = {
    "m": 1.0, "km": 1000.0, "cm": 0.01, "mm": 0.001,
    "mi": 1609.344, "ft": 0.3048, "in": 0.0254, "yd": 0.9144,
    "kg": 1.0, "g": 0.001, "lb": 0.45359237, "oz": 0.028349523125,
    "s": 1.0, "min": 60.0, "h": 3600.0, "day": 86400.0,
}  # fmt: skip
DIMENSION = {unit: dim for dim, units in (
    ("length", "m km cm mm mi ft in yd"), ("mass", "kg g lb oz"), ("time", "s min h day"),
) for unit in units.split()}  # fmt: skip
TO_KELVIN = {"C": lambda t: t + 273.15, "F": lambda t: (t - 32) * 5 / 9 + 273.15, "K": float}
FROM_KELVIN = {"C": lambda k: k - 273.15, "F": lambda k: (k - 273.15) * 9 / 5 + 32, "K": float}


def number_text(x: float) -> str:
    """At most 6 decimals, no trailing zeros: what the tools answer and the labels hold."""
    return f"{x:.6f}".rstrip("0").rstrip(".") or "0"


def evaluate(expression: str) -> float:
    """Arithmetic only (numbers, + - * / **, parentheses): a parsed tree, never eval()."""

    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return float(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            if isinstance(node.op, ast.Pow) and abs(walk(node.right)) > 64:
                raise ValueError("exponent too large")
            return _OPERATORS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](walk(node.operand))
        raise ValueError(f"unsupported expression: {ast.dump(node)[:60]}")

    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    return walk(ast.parse(expression, mode="eval").body)


def convert(value: float, from_unit: str, to_unit: str) -> float:
    if from_unit in TO_KELVIN and to_unit in TO_KELVIN:
        return FROM_KELVIN[to_unit](TO_KELVIN[from_unit](value))
    if from_unit not in FACTORS or to_unit not in FACTORS:
        raise ValueError(f"unknown unit: {from_unit if from_unit not in FACTORS else to_unit}")
    if DIMENSION[from_unit] != DIMENSION[to_unit]:
        raise ValueError(f"cannot convert {DIMENSION[from_unit]} to {DIMENSION[to_unit]}")
    return value * FACTORS[from_unit] / FACTORS[to_unit]


# Errors come back as text, so the model sees them and can try again.
@server.tool(structured_output=False)  # plain text results: what every client shows the model
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / ** and parentheses, e.g. "(3 + 4) * 2.5"."""
    try:
        return number_text(evaluate(expression))
    except (ValueError, SyntaxError, ZeroDivisionError, OverflowError) as e:
        return f"error: {e}"


@server.tool(structured_output=False)
def convert_units(value: float, from_unit: str, to_unit: str) -> str:
    """Convert a value between units: m km cm mm mi ft in yd, kg g lb oz, s min h day, C F K."""
    try:
        return number_text(convert(value, from_unit, to_unit))
    except ValueError as e:
        return f"error: {e}"


if __name__ == "__main__":
    server.run()  # the stdio transport: JSON-RPC on stdin and stdout
