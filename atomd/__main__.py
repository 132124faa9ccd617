from atomd.cli import main

main()
