import os

# Qt tests render offscreen: CI has no display, and a developer's desktop
# shouldn't flash windows while the suite runs.
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
