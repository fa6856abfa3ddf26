from ddp_lab.scale import main

main()
