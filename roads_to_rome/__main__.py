from roads_to_rome.cli.main import main

main()
