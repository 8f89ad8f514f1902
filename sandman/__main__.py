from sandman.cli import main

main()
