"""``python -m fedflat.engine.native``: builds fedflat's native operators now (``make`` runs it at setup) and says
whether they load; exits 0 either way, since the Python path runs where they cannot be built."""
from fedflat.engine.native import status

if __name__ == "__main__":
    print(status())
