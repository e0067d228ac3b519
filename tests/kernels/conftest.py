import os
import tempfile

# the C++ kernels are built once per machine into this folder (a few seconds to load once built)
os.environ.setdefault("RSMEM_KERNELS_DIR", os.path.join(tempfile.gettempdir(), "rsmem-test-kernels"))
