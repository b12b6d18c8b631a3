from r2r.cli import main

main()
