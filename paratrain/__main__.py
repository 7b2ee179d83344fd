import sys

from paratrain.cli import main
from paratrain.host_memory import restart_with_allocator

restart_with_allocator(sys.argv[1:])
sys.exit(main())
