import sys

from kvpush.cli import main

sys.exit(main())
