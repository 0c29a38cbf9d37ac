import sys

from tools.coli_kv import main

sys.exit(main())
