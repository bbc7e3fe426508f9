import os
import sys

# Tests import their helpers (references, models) from this folder.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
