import sys

from engine_cluster.app import main

sys.exit(main())
