from llmgw_cli.main import main

main()
