"""Framework implementations of tome_core's array ops and of the module hooks the adapters use.

Each submodule imports its framework; nothing here is imported until a tensor or model of that
framework is seen.
"""
