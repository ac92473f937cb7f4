from weaved.cli.app import main

main()
