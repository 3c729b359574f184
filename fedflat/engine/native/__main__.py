"""``python -m fedflat.engine.native``: builds fedflat's native operators now (``make`` runs it at setup) and says
whether they load; a build that failed before on this machine is tried again. Exits 0 either way, since the Python
path runs where they cannot be built."""
from fedflat.engine.native import forget_failure, status

if __name__ == "__main__":
    forget_failure()
    print(status())
