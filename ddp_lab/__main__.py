from ddp_lab.train import main

main()
